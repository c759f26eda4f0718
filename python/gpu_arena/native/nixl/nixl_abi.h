// nixl_abi.h: our own declarations of the backend-plugin ABI of NIXL release 1.5.1 (the PyPI
// wheels nixl-cu12 / nixl-cu13 1.5.1), enough to build libplugin_GPU_ARENA.so without NIXL's
// headers (the wheels ship none). Written for gpu-arena; no NIXL source is copied here.
//
// Where the facts come from: the 1.5.1 binaries themselves. Vtable order from the relocations
// of `vtable for nixlBackendEngine` and of every engine in the wheel's plugins/ (UCX, POSIX,
// GDS, GDS_MT, LIBFABRIC, OBJ, AZURE_BLOB, GUSLI, GPUNETIO); the engine base layout from the
// base constructor inlined into nixlPosixEngine's and from libnixl.so's nixlAgent::createBackend
// (getInitErr at +0xa0, the init params on its stack), getBackendParams (custom params at +0x28)
// and nixlEngineDeleter (type at +0x08); plugin struct from backendLoader (api_version == 1)
// and nixlBackendPluginHandle; descriptor sizes from nixlDescList<T>::operator[] in
// libnixl_build.so; enum values from libnixl.so's own nixlEnumStrings and the Python bindings.
// Verified by a probe plugin built only from this header and driven by the real 1.5.1 wheel
// (two agents, READ/WRITE with notifications, every virtual logged in its intended slot).
//
// NIXL checks nothing but api_version == 1, which stayed 1 while the engine vtable changed many
// times: a plugin built with this header must be loaded only by NIXL 1.5.1 (kNixlAbiRelease).
// Build it with -std=c++20 -fvisibility=hidden -fvisibility-inlines-hidden against the new
// libstdc++ ABI (_GLIBCXX_USE_CXX11_ABI=1); it links against no NIXL library.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(_GLIBCXX_USE_CXX11_ABI) || !_GLIBCXX_USE_CXX11_ABI
#error "NIXL 1.5.1 is built with libstdc++'s new (cxx11) string ABI"
#endif

namespace gpu_arena_native::nixl_abi {
inline constexpr char kNixlAbiRelease[] = "1.5.1";  // the only NIXL release this matches
inline constexpr int kPluginApiVersion = 1;          // what 1.5.1's backendLoader accepts
}  // namespace gpu_arena_native::nixl_abi

// ---- Enums and aliases (global names: they appear in NIXL's mangled signatures) ----------
enum nixl_status_t : int {
  NIXL_IN_PROG = 1,
  NIXL_SUCCESS = 0,
  NIXL_ERR_NOT_POSTED = -1,
  NIXL_ERR_INVALID_PARAM = -2,
  NIXL_ERR_BACKEND = -3,
  NIXL_ERR_NOT_FOUND = -4,
  NIXL_ERR_MISMATCH = -5,
  NIXL_ERR_NOT_ALLOWED = -6,
  NIXL_ERR_REPOST_ACTIVE = -7,
  NIXL_ERR_UNKNOWN = -8,
  NIXL_ERR_NOT_SUPPORTED = -9,
  NIXL_ERR_REMOTE_DISCONNECT = -10,
  NIXL_ERR_CANCELED = -11,
  NIXL_ERR_NO_TELEMETRY = -12,
};
enum nixl_mem_t : int { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };
enum nixl_xfer_op_t : int { NIXL_READ = 0, NIXL_WRITE = 1 };
enum class nixl_thread_sync_t : int { NONE = 0, STRICT = 1, RW = 2 };
enum class nixl_cost_t : int { ANALYTICAL_BACKEND = 0 };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;  // bytes, may hold '\0'
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;  // {sender agent, msg}
using nixlMemViewH = void *;

struct nixlAgentOptionalArgs;  // opaque here; only a pointer to it crosses (estimateXferCost)
class nixlBackendMD;

// ---- Descriptors (plain, non-polymorphic) -------------------------------------------------
class nixlBasicDesc {
 public:
  uintptr_t addr;  // start (or offset for files)
  size_t len;
  uint64_t devId;  // device / block / file id

  nixlBasicDesc() = default;
  nixlBasicDesc(uintptr_t a, size_t l, uint64_t dev) : addr(a), len(l), devId(dev) {}
  bool covers(const nixlBasicDesc &q) const noexcept {
    return devId == q.devId && addr <= q.addr && addr + len >= q.addr + q.len;
  }
};

class nixlBlobDesc : public nixlBasicDesc {
 public:
  nixl_blob_t metaInfo;  // at registration: user blob; at loadRemoteMD: the peer's public data
};

class nixlMetaDesc : public nixlBasicDesc {
 public:
  nixlBackendMD *metadataP = nullptr;  // what registerMem / loadRemoteMD / loadLocalMD returned
};

struct nixlRemoteMetaDesc : public nixlMetaDesc {
  std::string remoteAgent;
};

// nixlDescList<T>: instantiated inside NIXL (libnixl_build.so). A plugin only reads lists NIXL
// hands it, so construction is deleted and the out-of-line virtuals are declared but never
// defined or referenced: they only reserve the vptr at +0. Layout: vptr, mem type, vector<T>.
template <class T>
class nixlDescList {
 protected:
  nixl_mem_t mem_type_;
  std::vector<T> items_;

 public:
  nixlDescList() = delete;
  nixlDescList(const nixlDescList &) = delete;
  nixlDescList &operator=(const nixlDescList &) = delete;
  virtual ~nixlDescList() = default;                     // vtable slots 0, 1
  virtual void resize(const size_t &count);              // slot 2 (NIXL's own)
  virtual void addDesc(const T &desc);                   // slot 3 (NIXL's own)
  virtual int getIndex(const nixlBasicDesc &q) const;    // slot 4 (NIXL's own)

  nixl_mem_t getType() const noexcept { return mem_type_; }
  int descCount() const noexcept { return static_cast<int>(items_.size()); }
  bool isEmpty() const noexcept { return items_.empty(); }
  const T &operator[](size_t i) const noexcept { return items_[i]; }
  typename std::vector<T>::const_iterator begin() const noexcept { return items_.begin(); }
  typename std::vector<T>::const_iterator end() const noexcept { return items_.end(); }
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

// ---- Backend-owned polymorphic handles ----------------------------------------------------
class nixlBackendMD {  // base of every per-registration metadata object; NIXL never deletes it
 protected:
  bool isPrivateMD;

 public:
  explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
  virtual ~nixlBackendMD() {}
};

class nixlBackendReqH {  // base of every transfer request handle; released via releaseReqH
 public:
  nixlBackendReqH() {}
  virtual ~nixlBackendReqH() {}
};

// ---- Per-call options and init parameters -------------------------------------------------
struct nixlBackendOptionalArgs {  // nixl_opt_b_args_t
  nixl_blob_t notifMsg;           // +0x00
  bool hasNotif = false;          // +0x20: deliver notifMsg to the target once the data is there
  nixl_blob_t customParam;        // +0x28
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

class nixlBackendInitParams {  // filled by nixlAgent::createBackend on its stack
 public:
  std::string localAgent;                    // +0x00
  nixl_backend_t type;                       // +0x20
  nixl_b_params_t *customParams = nullptr;   // +0x40: create_backend(name, params)
  bool enableProgTh = false;                 // +0x48
  uint64_t pthrDelay = 0;                    // +0x50, microseconds
  nixl_thread_sync_t syncMode{};             // +0x58
  bool enableTelemetry_ = false;             // +0x5c
};

namespace gpu_arena_native::nixl_abi {
struct TelemetryRecord {  // element of the engine's telemetry queue (16 bytes, trivial)
  uint32_t type;
  uint64_t value;
};
struct LayoutCheck;
}  // namespace gpu_arena_native::nixl_abi

// ---- The engine ---------------------------------------------------------------------------
// Vtable slots (index from the address point; 0/1 are the complete and deleting destructors).
// NIXL destroys an engine only through the plugin's destroy_engine.
class nixlBackendEngine {
  nixl_backend_t backend_type_;                                          // +0x08
  nixl_b_params_t custom_params_;                                        // +0x28
  std::vector<gpu_arena_native::nixl_abi::TelemetryRecord> telemetry_;  // +0x60
  std::mutex telemetry_mu_;                                              // +0x78
  friend struct gpu_arena_native::nixl_abi::LayoutCheck;

 protected:
  bool init_error_ = false;          // +0xa0: set in the constructor to make createBackend fail
  const std::string local_agent_;    // +0xa8
  const bool telemetry_enabled_;     // +0xc8

  nixl_status_t getInitParam(const std::string &key, std::string &value) const {
    auto it = custom_params_.find(key);
    if (it == custom_params_.end()) return NIXL_ERR_INVALID_PARAM;
    value = it->second;
    return NIXL_SUCCESS;
  }
  void addTelemetryEvent(uint32_t type, uint64_t value) {
    if (!telemetry_enabled_) return;
    std::lock_guard<std::mutex> g(telemetry_mu_);
    if (telemetry_.size() < 1000) telemetry_.push_back({type, value});
  }

 public:
  explicit nixlBackendEngine(const nixlBackendInitParams *p)
      : backend_type_(p->type),
        custom_params_(p->customParams ? *p->customParams : nixl_b_params_t{}),
        local_agent_(p->localAgent),
        telemetry_enabled_(p->enableTelemetry_) {}
  nixlBackendEngine(const nixlBackendEngine &) = delete;
  nixlBackendEngine &operator=(const nixlBackendEngine &) = delete;
  virtual ~nixlBackendEngine() = default;  // slots 0, 1

  // NIXL inlines these at the offsets above.
  bool getInitErr() const noexcept { return init_error_; }
  const nixl_backend_t &getType() const noexcept { return backend_type_; }
  const nixl_b_params_t &getCustomParams() const noexcept { return custom_params_; }
  const std::string &localAgent() const noexcept { return local_agent_; }

  virtual bool supportsRemote() const = 0;                // 2
  virtual bool supportsLocal() const = 0;                 // 3
  virtual bool supportsNotif() const = 0;                 // 4
  virtual nixl_mem_list_t getSupportedMems() const = 0;   // 5
  virtual nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &mem_type,
                                    nixlBackendMD *&out) = 0;                       // 6
  virtual nixl_status_t deregisterMem(nixlBackendMD *md) = 0;                       // 7
  virtual nixl_status_t connect(const std::string &remote_agent) = 0;               // 8
  virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;            // 9
  virtual nixl_status_t unloadMD(nixlBackendMD *md) = 0;                            // 10
  virtual nixl_status_t prepXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
                                 const nixl_meta_dlist_t &remote,
                                 const std::string &remote_agent, nixlBackendReqH *&handle,
                                 const nixl_opt_b_args_t *opt_args = nullptr) const = 0;  // 11
  virtual nixl_status_t postXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
                                 const nixl_meta_dlist_t &remote,
                                 const std::string &remote_agent, nixlBackendReqH *&handle,
                                 const nixl_opt_b_args_t *opt_args = nullptr) const = 0;  // 12
  virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;               // 13
  virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;             // 14

  // Device-side memory views (overload order matters: remote first).
  virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                    const nixl_opt_b_args_t * = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }  // 15
  virtual nixl_status_t prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &,
                                    const nixl_opt_b_args_t * = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }  // 16
  virtual void releaseMemView(nixlMemViewH) const {}  // 17

  // Needed when supportsRemote().
  virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
    return NIXL_ERR_BACKEND;
  }  // 18
  virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }  // 19
  virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
    return NIXL_ERR_BACKEND;
  }  // 20
  virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &,
                                     const std::string &, nixlBackendMD *&) {
    return NIXL_ERR_BACKEND;
  }  // 21
  // Needed when supportsLocal().
  virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) {
    return NIXL_ERR_BACKEND;
  }  // 22
  // Needed when supportsNotif().
  virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }  // 23
  virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
    return NIXL_ERR_BACKEND;
  }  // 24
  // Optional.
  virtual nixl_status_t queryMem(const nixl_reg_dlist_t &,
                                 std::vector<nixl_query_resp_t> &) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }  // 25
  virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                         const nixl_meta_dlist_t &, const std::string &,
                                         nixlBackendReqH *const &, std::chrono::microseconds &,
                                         std::chrono::microseconds &, nixl_cost_t &,
                                         const nixlAgentOptionalArgs * = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }  // 26
};

// ---- Plugin descriptor returned by nixl_plugin_init ---------------------------------------
class nixlBackendPlugin {
 public:
  int api_version;                                                   // +0x00, must be 1
  nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *);  // +0x08
  void (*destroy_engine)(nixlBackendEngine *);                       // +0x10
  const char *(*get_plugin_name)();                                  // +0x18
  const char *(*get_plugin_version)();                               // +0x20
  nixl_b_params_t (*get_backend_options)();                          // +0x28
  nixl_mem_list_t (*get_backend_mems)();                             // +0x30
};

// Entry points NIXL dlsym()s (RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE); fini runs at unload.
extern "C" {
__attribute__((visibility("default"))) nixlBackendPlugin *nixl_plugin_init();
__attribute__((visibility("default"))) void nixl_plugin_fini();
}

// ---- Layout checks (values read off the 1.5.1 binaries) -----------------------------------
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
namespace gpu_arena_native::nixl_abi {
struct LayoutCheck {
  static_assert(sizeof(std::string) == 32 && sizeof(nixl_b_params_t) == 56);
  static_assert(sizeof(std::mutex) == 40 && sizeof(TelemetryRecord) == 16);
  static_assert(sizeof(nixl_status_t) == 4 && sizeof(nixl_mem_t) == 4);
  static_assert(sizeof(nixlBasicDesc) == 24 && offsetof(nixlBasicDesc, devId) == 16);
  static_assert(sizeof(nixlBlobDesc) == 56 && offsetof(nixlBlobDesc, metaInfo) == 24);
  static_assert(sizeof(nixlMetaDesc) == 32 && offsetof(nixlMetaDesc, metadataP) == 24);
  static_assert(sizeof(nixlRemoteMetaDesc) == 64);
  static_assert(sizeof(nixlDescList<nixlMetaDesc>) == 40);
  static_assert(sizeof(nixlBackendMD) == 16 && sizeof(nixlBackendReqH) == 8);
  static_assert(sizeof(nixlBackendOptionalArgs) == 72);
  static_assert(offsetof(nixlBackendOptionalArgs, hasNotif) == 0x20);
  static_assert(offsetof(nixlBackendOptionalArgs, customParam) == 0x28);
  static_assert(sizeof(nixlBackendInitParams) == 0x60);
  static_assert(offsetof(nixlBackendInitParams, type) == 0x20);
  static_assert(offsetof(nixlBackendInitParams, customParams) == 0x40);
  static_assert(offsetof(nixlBackendInitParams, enableProgTh) == 0x48);
  static_assert(offsetof(nixlBackendInitParams, pthrDelay) == 0x50);
  static_assert(offsetof(nixlBackendInitParams, syncMode) == 0x58);
  static_assert(offsetof(nixlBackendInitParams, enableTelemetry_) == 0x5c);
  static_assert(sizeof(nixlBackendEngine) == 0xd0);
  static_assert(offsetof(nixlBackendEngine, backend_type_) == 0x08);
  static_assert(offsetof(nixlBackendEngine, custom_params_) == 0x28);
  static_assert(offsetof(nixlBackendEngine, telemetry_) == 0x60);
  static_assert(offsetof(nixlBackendEngine, telemetry_mu_) == 0x78);
  static_assert(offsetof(nixlBackendEngine, init_error_) == 0xa0);
  static_assert(offsetof(nixlBackendEngine, local_agent_) == 0xa8);
  static_assert(offsetof(nixlBackendEngine, telemetry_enabled_) == 0xc8);
  static_assert(sizeof(nixlBackendPlugin) == 0x38);
  static_assert(offsetof(nixlBackendPlugin, get_backend_mems) == 0x30);
};
#pragma GCC diagnostic pop

// Vtable slot of a virtual member function (Itanium C++ ABI: a pointer to a virtual member
// holds 1 + its byte offset from the address point). Runtime only; see vtableMatches().
template <class F>
inline long vtableSlot(F pmf) {
  static_assert(sizeof(F) == 2 * sizeof(void *));
  uintptr_t raw[2];
  std::memcpy(raw, &pmf, sizeof raw);
  return (raw[0] & 1) ? static_cast<long>((raw[0] - 1) / sizeof(void *)) : -1;
}

// True when every engine method sits in the slot 1.5.1's vtables give it.
inline bool vtableMatches() {
  using E = nixlBackendEngine;
  using RemoteView = nixl_status_t (E::*)(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                          const nixl_opt_b_args_t *) const;
  using LocalView = nixl_status_t (E::*)(const nixl_meta_dlist_t &, nixlMemViewH &,
                                         const nixl_opt_b_args_t *) const;
  const long got[] = {
      vtableSlot(&E::supportsRemote), vtableSlot(&E::supportsLocal),
      vtableSlot(&E::supportsNotif), vtableSlot(&E::getSupportedMems),
      vtableSlot(&E::registerMem), vtableSlot(&E::deregisterMem), vtableSlot(&E::connect),
      vtableSlot(&E::disconnect), vtableSlot(&E::unloadMD), vtableSlot(&E::prepXfer),
      vtableSlot(&E::postXfer), vtableSlot(&E::checkXfer), vtableSlot(&E::releaseReqH),
      vtableSlot(static_cast<RemoteView>(&E::prepMemView)),
      vtableSlot(static_cast<LocalView>(&E::prepMemView)), vtableSlot(&E::releaseMemView),
      vtableSlot(&E::getPublicData), vtableSlot(&E::getConnInfo),
      vtableSlot(&E::loadRemoteConnInfo), vtableSlot(&E::loadRemoteMD),
      vtableSlot(&E::loadLocalMD), vtableSlot(&E::getNotifs), vtableSlot(&E::genNotif),
      vtableSlot(&E::queryMem), vtableSlot(&E::estimateXferCost)};
  for (long i = 0; i < static_cast<long>(std::size(got)); ++i)
    if (got[i] != i + 2) return false;
  return true;
}

// Fills the static nixlBackendPlugin for Engine (constructed as Engine(const init params*)).
// Name/version must be string literals (or otherwise outlive the process).
template <class Engine, const char *Name, const char *Version>
struct PluginTable {
  static nixlBackendEngine *create(const nixlBackendInitParams *p) noexcept {
    try {
      return new Engine(p);
    } catch (...) {
      return nullptr;
    }
  }
  static void destroy(nixlBackendEngine *e) noexcept { delete e; }
  static const char *name() { return Name; }
  static const char *version() { return Version; }
  static nixl_b_params_t options() { return Engine::backendOptions(); }
  static nixl_mem_list_t mems() { return Engine::backendMems(); }
  static nixlBackendPlugin *get() {
    static nixlBackendPlugin table{kPluginApiVersion, &create, &destroy, &name,
                                   &version, &options, &mems};
    return &table;
  }
};
}  // namespace gpu_arena_native::nixl_abi
