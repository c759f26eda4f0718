//! Arbitrary bytes -> `ShareHandle::from_bytes`: never panics; an accepted handle
//! re-encodes to the same 128 bytes and decodes to the same value.
#![no_main]

use gpu_arena::ipc::{ShareHandle, HANDLE_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data);
    // Most random inputs fail the length or magic check; also try the input laid over a
    // valid prefix so the fuzzer reaches the field checks quickly.
    if data.len() >= 10 {
        let mut b = [0u8; HANDLE_BYTES];
        b[..8].copy_from_slice(b"GPUARENA");
        b[8] = 1;
        let n = (data.len() - 10).min(HANDLE_BYTES - 10);
        b[10..10 + n].copy_from_slice(&data[10..10 + n]);
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
