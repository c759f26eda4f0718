//! Arbitrary bytes -> the transfer engine's decoders (`gpu_arena::transfer::wire`): what
//! arrives on an engine's socket from another process, and a peer's public data. Never a
//! panic; an accepted message re-encodes to the same bytes, an accepted public data to text
//! that decodes to the same value.
#![no_main]

use gpu_arena::transfer::wire::{Message, PublicData};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        assert_eq!(
            m.encode(),
            data,
            "encode does not round-trip an accepted message"
        );
    }
    // Laid over a valid header, so the fuzzer reaches the fields quickly.
    let mut framed = b"GAX1".to_vec();
    framed.extend_from_slice(data);
    if let Ok(m) = Message::decode(&framed) {
        assert_eq!(m.encode(), framed);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        for t in [text.to_owned(), format!("gpu-arena-xfer/1;{text}")] {
            if let Ok(p) = PublicData::decode(&t) {
                let again =
                    PublicData::decode(&p.encode()).expect("re-encoded public data refused");
                assert_eq!(again, p, "decode(encode(p)) != p");
            }
        }
    }
});
