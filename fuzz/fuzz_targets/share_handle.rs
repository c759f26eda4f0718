//! Arbitrary bytes -> `ShareHandle::from_bytes`: never panics; an accepted handle
//! re-encodes to the same 128 bytes and decodes to the same value.
#![no_main]

use gpu_arena::ipc::handle::{layout, HANDLE_MAGIC, HANDLE_VERSION};
use gpu_arena::ipc::{ShareHandle, HANDLE_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data);
    // Most random inputs fail the length or magic check; also try the input laid over a
    // valid prefix so the fuzzer reaches the field checks quickly.
    let head = layout::VERSION.range().end;
    if data.len() >= head {
        let mut b = [0u8; HANDLE_BYTES];
        b[layout::MAGIC.range()].copy_from_slice(HANDLE_MAGIC);
        b[layout::VERSION.range()].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        let n = (data.len() - head).min(HANDLE_BYTES - head);
        b[head..head + n].copy_from_slice(&data[head..head + n]);
        check(&b);
    }
});

fn check(data: &[u8]) {
    if let Ok(h) = ShareHandle::from_bytes(data) {
        let bytes = h.to_bytes();
        assert_eq!(
            &bytes[..],
            data,
            "to_bytes does not round-trip an accepted handle"
        );
        let again = ShareHandle::from_bytes(&bytes).expect("re-encoded handle refused");
        assert_eq!(again, h, "decode(encode(h)) != h");
    }
}
