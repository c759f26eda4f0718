#![doc = include_str!("../../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod error;
pub mod range;

pub use backend::{Backend, DeviceId, StreamId};
pub use error::{Error, Result};
