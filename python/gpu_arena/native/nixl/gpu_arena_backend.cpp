// gpu_arena_backend.cpp: NIXL's backend GPU_ARENA (libplugin_GPU_ARENA.so), a thin map of
// NIXL's engine calls onto gpu-arena's transfer engine (gpu_arena_xfer_*, Rust:
// alloc/src/transfer/). Everything that decides lives there: registrations as shares,
// imports, copies on the engine's streams, notifications, revocation. This file only turns
// NIXL's descriptor lists and handles into ids and back.
//
// Built by gpu_arena/nixl_plugin.py against nixl_abi.h (our declarations of NIXL 1.5.1's
// plugin ABI) with -DGPU_ARENA_LIB="<path of libgpu_arena.so>": the plugin binds that
// library with dlopen(RTLD_NOLOAD) first, so it shares the process's pool with gpu_arena's
// Python package (and its PyTorch allocator), and links no NIXL library.

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "nixl_abi.h"

#ifndef GPU_ARENA_LIB
#error "build with -DGPU_ARENA_LIB=\"/path/to/libgpu_arena.so\" (gpu_arena/nixl_plugin.py does)"
#endif

namespace {

// gpu_arena_xfer_desc_t of ffi/include/gpu_arena.h.
struct XferDesc {
  uint64_t addr, len, md;
};
using NotifCb = void (*)(void*, const char*, size_t, const char*, size_t);

// X(name, parameter types...): int gpu_arena_xfer_<name>(...).
#define GPU_ARENA_XFER_FNS(X)                                                      \
  X(engine_new, const char*, uint64_t*)                                            \
  X(engine_free, uint64_t)                                                         \
  X(conn_info, uint64_t, char**)                                                   \
  X(load_conn_info, uint64_t, const char*, const char*)                            \
  X(forget_agent, uint64_t, const char*)                                           \
  X(register_mem, uint64_t, uint64_t, uint64_t, uint64_t*)                             \
  X(deregister_mem, uint64_t, uint64_t)                                                \
  X(public_data, uint64_t, uint64_t, char**)                                       \
  X(load_remote, uint64_t, const char*, const char*, size_t, uint64_t*)            \
  X(load_local, uint64_t, uint64_t, uint64_t*)                                     \
  X(unload, uint64_t, uint64_t)                                                    \
  X(prepare, uint64_t, int, const XferDesc*, const XferDesc*, size_t, const char*, \
    uint64_t*)                                                                     \
  X(post, uint64_t, uint64_t, const char*, size_t, int*)                           \
  X(check, uint64_t, uint64_t, int*)                                               \
  X(release, uint64_t, uint64_t)                                                   \
  X(notify, uint64_t, const char*, const char*, size_t)                            \
  X(take_notifs, uint64_t, NotifCb, void*)

constexpr int kInvalidArgument = -1, kUnknownPointer = -3, kInvalidState = -7, kIpc = -9;
constexpr int kInProgress = 1, kDone = 2;

struct Api {
#define FIELD(name, ...) int (*name)(__VA_ARGS__) = nullptr;
  GPU_ARENA_XFER_FNS(FIELD)
#undef FIELD
  const char* (*last_error)() = nullptr;
  void (*string_free)(char*) = nullptr;
};

// Bind libgpu_arena once; "" on success, else why not.
const std::string& bind(Api& api) {
  static std::string why = [&]() -> std::string {
    void* h = dlopen(GPU_ARENA_LIB, RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen(GPU_ARENA_LIB, RTLD_NOW);
    if (h == nullptr) {
      const char* e = dlerror();
      return std::string("dlopen(" GPU_ARENA_LIB ") failed: ") + (e ? e : "?");
    }
    std::string missing;
#define BIND(name, ...)                                                              \
  api.name = reinterpret_cast<int (*)(__VA_ARGS__)>(dlsym(h, "gpu_arena_xfer_" #name)); \
  if (api.name == nullptr) missing += " gpu_arena_xfer_" #name;
    GPU_ARENA_XFER_FNS(BIND)
#undef BIND
    api.last_error = reinterpret_cast<const char* (*)()>(dlsym(h, "gpu_arena_last_error"));
    api.string_free = reinterpret_cast<void (*)(char*)>(dlsym(h, "gpu_arena_string_free"));
    if (api.last_error == nullptr || api.string_free == nullptr) missing += " (error calls)";
    if (!missing.empty()) return GPU_ARENA_LIB " lacks" + missing + " (an older libgpu_arena)";
    return "";
  }();
  return why;
}

Api api;

// NIXL's status for a gpu-arena error code, with the error's words on stderr (NIXL's
// Python API raises the status only).
nixl_status_t failed(const char* call, int code) {
  const char* why = api.last_error ? api.last_error() : nullptr;
  std::fprintf(stderr, "GPU_ARENA backend: %s: %s\n", call, why && *why ? why : "failed");
  switch (code) {
    case kInvalidArgument:
    case kUnknownPointer:
      return NIXL_ERR_INVALID_PARAM;
    case kInvalidState:
      return NIXL_ERR_NOT_ALLOWED;
    case kIpc:
      return NIXL_ERR_REMOTE_DISCONNECT;
    default:
      return NIXL_ERR_BACKEND;
  }
}

// A copy of a string gpu-arena handed out, freed there.
std::string take(char* s) {
  std::string out = s ? s : "";
  if (s) api.string_free(s);
  return out;
}

// A registration (local or loaded) as NIXL holds it: the engine's metadata id.
class ArenaMD : public nixlBackendMD {
 public:
  explicit ArenaMD(uint64_t id) : nixlBackendMD(true), id(id) {}
  const uint64_t id;
};

// A transfer request: the engine's request id.
class ArenaReq : public nixlBackendReqH {
 public:
  explicit ArenaReq(uint64_t id) : id(id) {}
  const uint64_t id;
};

uint64_t md_id(const nixlBackendMD* md) {
  auto* a = dynamic_cast<const ArenaMD*>(md);
  return a ? a->id : 0;
}

std::vector<XferDesc> descs(const nixl_meta_dlist_t& list) {
  std::vector<XferDesc> out;
  out.reserve(static_cast<size_t>(list.descCount()));
  for (const nixlMetaDesc& d : list) out.push_back({d.addr, d.len, md_id(d.metadataP)});
  return out;
}

bool supported(nixl_mem_t m) { return m == DRAM_SEG || m == VRAM_SEG; }

class GpuArenaEngine : public nixlBackendEngine {
 public:
  explicit GpuArenaEngine(const nixlBackendInitParams* p) : nixlBackendEngine(p) {
    const std::string& why = bind(api);
    if (!why.empty()) {
      std::fprintf(stderr, "GPU_ARENA backend: %s\n", why.c_str());
      init_error_ = true;
      return;
    }
    int rc = api.engine_new(localAgent().c_str(), &engine_);
    if (rc != 0) {
      failed("starting the engine", rc);
      init_error_ = true;
    }
  }
  ~GpuArenaEngine() override {
    if (engine_ != 0 && api.engine_free(engine_) != 0) failed("stopping the engine", -10);
  }

  static nixl_b_params_t backendOptions() { return {}; }
  static nixl_mem_list_t backendMems() { return {DRAM_SEG, VRAM_SEG}; }

  bool supportsRemote() const override { return true; }
  bool supportsLocal() const override { return true; }
  bool supportsNotif() const override { return true; }
  nixl_mem_list_t getSupportedMems() const override { return backendMems(); }

  nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& type,
                            nixlBackendMD*& out) override {
    if (!supported(type)) return NIXL_ERR_NOT_SUPPORTED;
    uint64_t md = 0;
    int rc = api.register_mem(engine_, mem.addr, mem.len, &md);
    if (rc != 0) return failed("registerMem", rc);
    out = new ArenaMD(md);
    return NIXL_SUCCESS;
  }
  nixl_status_t deregisterMem(nixlBackendMD* md) override {
    int rc = api.deregister_mem(engine_, md_id(md));
    delete md;
    return rc == 0 ? NIXL_SUCCESS : failed("deregisterMem", rc);
  }
  nixl_status_t connect(const std::string&) override { return NIXL_SUCCESS; }
  nixl_status_t disconnect(const std::string& agent) override {
    int rc = api.forget_agent(engine_, agent.c_str());
    return rc == 0 ? NIXL_SUCCESS : failed("disconnect", rc);
  }
  nixl_status_t unloadMD(nixlBackendMD* md) override {
    int rc = api.unload(engine_, md_id(md));
    delete md;
    return rc == 0 ? NIXL_SUCCESS : failed("unloadMD", rc);
  }

  nixl_status_t getPublicData(const nixlBackendMD* md, std::string& out) const override {
    char* s = nullptr;
    int rc = api.public_data(engine_, md_id(md), &s);
    if (rc != 0) return failed("getPublicData", rc);
    out = take(s);
    return NIXL_SUCCESS;
  }
  nixl_status_t getConnInfo(std::string& out) const override {
    char* s = nullptr;
    int rc = api.conn_info(engine_, &s);
    if (rc != 0) return failed("getConnInfo", rc);
    out = take(s);
    return NIXL_SUCCESS;
  }
  nixl_status_t loadRemoteConnInfo(const std::string& agent, const std::string& info) override {
    int rc = api.load_conn_info(engine_, agent.c_str(), info.c_str());
    return rc == 0 ? NIXL_SUCCESS : failed("loadRemoteConnInfo", rc);
  }
  nixl_status_t loadRemoteMD(const nixlBlobDesc& blob, const nixl_mem_t& type,
                             const std::string& agent, nixlBackendMD*& out) override {
    if (!supported(type)) return NIXL_ERR_NOT_SUPPORTED;
    uint64_t md = 0;
    int rc = api.load_remote(engine_, agent.c_str(), blob.metaInfo.data(), blob.metaInfo.size(),
                             &md);
    if (rc != 0) return failed("loadRemoteMD", rc);
    out = new ArenaMD(md);
    return NIXL_SUCCESS;
  }
  nixl_status_t loadLocalMD(nixlBackendMD* in, nixlBackendMD*& out) override {
    uint64_t md = 0;
    int rc = api.load_local(engine_, md_id(in), &md);
    if (rc != 0) return failed("loadLocalMD", rc);
    out = new ArenaMD(md);
    return NIXL_SUCCESS;
  }

  nixl_status_t prepXfer(const nixl_xfer_op_t& op, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& agent,
                         nixlBackendReqH*& handle, const nixl_opt_b_args_t*) const override {
    if (op != NIXL_READ && op != NIXL_WRITE) return NIXL_ERR_INVALID_PARAM;
    if (local.descCount() != remote.descCount()) return NIXL_ERR_MISMATCH;
    std::vector<XferDesc> l = descs(local), r = descs(remote);
    uint64_t req = 0;
    int rc = api.prepare(engine_, op == NIXL_READ ? 0 : 1, l.data(), r.data(), l.size(),
                         agent.c_str(), &req);
    if (rc != 0) return failed("prepXfer", rc);
    handle = new ArenaReq(req);
    return NIXL_SUCCESS;
  }
  nixl_status_t postXfer(const nixl_xfer_op_t&, const nixl_meta_dlist_t&, const nixl_meta_dlist_t&,
                         const std::string&, nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt) const override {
    auto* req = dynamic_cast<ArenaReq*>(handle);
    if (req == nullptr) return NIXL_ERR_INVALID_PARAM;
    bool notify = opt != nullptr && opt->hasNotif;
    int status = 0;
    int rc = api.post(engine_, req->id, notify ? opt->notifMsg.data() : nullptr,
                      notify ? opt->notifMsg.size() : 0, &status);
    if (rc != 0) return failed("postXfer", rc);
    return status == kDone ? NIXL_SUCCESS : NIXL_IN_PROG;
  }
  nixl_status_t checkXfer(nixlBackendReqH* handle) const override {
    auto* req = dynamic_cast<ArenaReq*>(handle);
    if (req == nullptr) return NIXL_ERR_INVALID_PARAM;
    int status = 0;
    int rc = api.check(engine_, req->id, &status);
    if (rc != 0) return failed("checkXfer", rc);
    return status == kInProgress ? NIXL_IN_PROG : NIXL_SUCCESS;
  }
  nixl_status_t releaseReqH(nixlBackendReqH* handle) const override {
    auto* req = dynamic_cast<ArenaReq*>(handle);
    if (req == nullptr) return NIXL_ERR_INVALID_PARAM;
    int rc = api.release(engine_, req->id);
    delete req;
    return rc == 0 ? NIXL_SUCCESS : failed("releaseReqH", rc);
  }

  nixl_status_t getNotifs(notif_list_t& list) override {
    auto push = [](void* ctx, const char* agent, size_t alen, const char* body, size_t blen) {
      static_cast<notif_list_t*>(ctx)->emplace_back(std::string(agent, alen),
                                                    std::string(body, blen));
    };
    int rc = api.take_notifs(engine_, push, &list);
    return rc >= 0 ? NIXL_SUCCESS : failed("getNotifs", rc);
  }
  nixl_status_t genNotif(const std::string& agent, const std::string& msg) const override {
    int rc = api.notify(engine_, agent.c_str(), msg.data(), msg.size());
    return rc == 0 ? NIXL_SUCCESS : failed("genNotif", rc);
  }

 private:
  uint64_t engine_ = 0;
};

constexpr char kName[] = "GPU_ARENA";
constexpr char kVersion[] = "0.1.0";
using Table = gpu_arena_native::nixl_abi::PluginTable<GpuArenaEngine, kName, kVersion>;

}  // namespace

extern "C" nixlBackendPlugin* nixl_plugin_init() {
  if (!gpu_arena_native::nixl_abi::vtableMatches()) {
    std::fprintf(stderr, "GPU_ARENA backend: nixl_abi.h's vtable is not NIXL 1.5.1's; not loaded\n");
    return nullptr;
  }
  return Table::get();
}

extern "C" void nixl_plugin_fini() {}
