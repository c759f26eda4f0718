//! The caller's view of `gpu_arena_import_dlpack` (and of each entry of
//! `gpu_arena_import_dlpack_many`): read from its `int64_t` array and checked, before
//! anything is imported, into DLPack's dtype and the shape and strides `dlpack_api.rs`
//! builds the tensor from.

use gpu_arena::Error;

/// Entries of the view array `gpu_arena_import_dlpack` reads before the shape and strides.
pub const GPU_ARENA_DLPACK_VIEW_HEAD: usize = 8;

// DLPack's dtype (dlpack.h, v0.x), read from the view; the rest of DLPack's ABI is
// `dlpack_api.rs`'s. Private: the header hands the managed tensor out as `void*`.
#[repr(C)]
pub(crate) struct DlDataType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

/// The caller's view, read from the `int64_t` array (layout in `gpu_arena_import_dlpack`).
pub(crate) struct View {
    pub(crate) nbytes: u64,
    pub(crate) dtype: DlDataType,
    pub(crate) itemsize: u64,
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
    pub(crate) flat: bool,
    pub(crate) storage_offset: i64,
    /// The `ndim` sizes, then the `ndim` strides: the layout of `Managed::dims` (a view
    /// kept as it is becomes the tensor's dims without another copy).
    pub(crate) dims: Vec<i64>,
}

impl View {
    pub(crate) fn shape(&self) -> &[i64] {
        &self.dims[..self.dims.len() / 2]
    }

    pub(crate) fn strides(&self) -> &[i64] {
        &self.dims[self.dims.len() / 2..]
    }
}

/// The view of `len` entries at `view` (NULL refused), every check of the view alone done.
pub(crate) fn read_view(view: *const i64, len: usize) -> Result<View, Error> {
    if view.is_null() {
        return Err(Error::invalid("view is NULL"));
    }
    if len < GPU_ARENA_DLPACK_VIEW_HEAD {
        return Err(Error::invalid(format!(
            "view has {len} entries, fewer than its {GPU_ARENA_DLPACK_VIEW_HEAD}-entry head"
        )));
    }
    // SAFETY: non-null, and per the header it points to `len` readable int64_t; read
    // unaligned (a caller may pass the bytes of a packed buffer).
    let at = |i: usize| unsafe { view.add(i).read_unaligned() };
    let ndim = at(7);
    if !(0..=64).contains(&ndim) || len as i64 != GPU_ARENA_DLPACK_VIEW_HEAD as i64 + 2 * ndim {
        return Err(Error::invalid(format!(
            "view of {len} entries with ndim {ndim} (expected {GPU_ARENA_DLPACK_VIEW_HEAD} + 2 * ndim, ndim <= 64)"
        )));
    }
    let n = ndim as usize;
    let dims: Vec<i64> = (0..2 * n)
        .map(|i| at(GPU_ARENA_DLPACK_VIEW_HEAD + i))
        .collect();
    let dtype = at(1);
    // The highest DLPack type code (`kDLFloat4_e2m1fn`, DLPack 1.1). (A local item:
    // cbindgen warns about a private one at module level.)
    const DL_MAX_TYPE_CODE: i64 = 17;
    if !(0..1 << 32).contains(&dtype) || (dtype & 0xff) > DL_MAX_TYPE_CODE {
        return Err(Error::invalid(format!(
            "dtype {dtype:#x} is no DLPack dtype (code <= {DL_MAX_TYPE_CODE} | bits << 8 | lanes << 16)"
        )));
    }
    let v = View {
        nbytes: u64::try_from(at(0)).map_err(|_| Error::invalid("negative nbytes"))?,
        dtype: DlDataType {
            code: (dtype & 0xff) as u8,
            bits: ((dtype >> 8) & 0xff) as u8,
            lanes: ((dtype >> 16) & 0xffff) as u16,
        },
        itemsize: u64::try_from(at(2)).unwrap_or(0),
        device_type: i32::try_from(at(3))
            .map_err(|_| Error::invalid("device_type out of range"))?,
        device_id: i32::try_from(at(4)).map_err(|_| Error::invalid("device_id out of range"))?,
        flat: at(5) != 0,
        storage_offset: at(6),
        dims,
    };
    if v.itemsize == 0
        || v.dtype.lanes == 0
        || u64::from(v.dtype.bits) * u64::from(v.dtype.lanes) != 8 * v.itemsize
    {
        return Err(Error::invalid(format!(
            "dtype (code {}, bits {}, lanes {}) and itemsize {} disagree",
            v.dtype.code, v.dtype.bits, v.dtype.lanes, v.itemsize
        )));
    }
    if v.shape().iter().any(|&d| d < 0) || v.storage_offset < 0 {
        return Err(Error::invalid(format!(
            "negative size in shape {:?} or storage offset {}",
            v.shape(),
            v.storage_offset
        )));
    }
    if !fits(&v) {
        return Err(Error::invalid(format!(
            "a view (storage offset {}, shape {:?}, strides {:?}) of {}-byte elements reaches outside the {}-byte storage",
            v.storage_offset,
            v.shape(),
            v.strides(),
            v.itemsize,
            v.nbytes
        )));
    }
    Ok(v)
}

/// Whether every element the view reaches (from its storage offset, with its sizes and
/// strides, negative strides included) lies inside the `nbytes` of storage: the tensor a
/// caller builds from it (flat: with `as_strided`) then reads nothing outside the mapping.
/// An empty view reaches nothing. Any overflow is "no".
fn fits(v: &View) -> bool {
    if v.shape().contains(&0) {
        return true;
    }
    let (mut lo, mut hi) = (v.storage_offset, v.storage_offset);
    for (&d, &s) in v.shape().iter().zip(v.strides()) {
        let Some(reach) = (d - 1).checked_mul(s) else {
            return false;
        };
        let end = if reach < 0 { &mut lo } else { &mut hi };
        match end.checked_add(reach) {
            Some(x) => *end = x,
            None => return false,
        }
    }
    let bytes = u64::try_from(hi)
        .ok()
        .and_then(|h| h.checked_add(1))
        .and_then(|n| n.checked_mul(v.itemsize));
    lo >= 0 && bytes.is_some_and(|b| b <= v.nbytes)
}

/// Whether the view, at storage offset 0, spans exactly `nbytes`: then a tensor built from
/// its shape and strides has the whole share as its storage (what PyTorch's `from_dlpack`
/// gives a storage: the bytes its sizes and strides reach).
pub(crate) fn spans_whole(v: &View) -> bool {
    if v.storage_offset != 0 || v.shape().contains(&0) {
        return false;
    }
    let mut last: i64 = 0;
    for (&d, &s) in v.shape().iter().zip(v.strides()) {
        match (d - 1).checked_mul(s).and_then(|x| last.checked_add(x)) {
            Some(x) if s >= 0 => last = x,
            _ => return false,
        }
    }
    u64::try_from(last)
        .ok()
        .and_then(|n| n.checked_add(1))
        .and_then(|n| n.checked_mul(v.itemsize))
        == Some(v.nbytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;

    /// A float view array (`itemsize` bytes per element, device CPU 0, not flat).
    pub(crate) fn view(
        nbytes: i64,
        itemsize: i64,
        offset: i64,
        shape: &[i64],
        strides: &[i64],
    ) -> Vec<i64> {
        let bits = 8 * itemsize;
        let mut v = vec![nbytes, 2 | bits << 8 | 1 << 16, itemsize, 1, 0, 0, offset];
        v.push(shape.len() as i64);
        v.extend_from_slice(shape);
        v.extend_from_slice(strides);
        v
    }

    fn read(v: &[i64]) -> Result<View, Error> {
        read_view(v.as_ptr(), v.len())
    }

    #[test]
    fn a_view_over_its_whole_storage_needs_no_strides_afterwards() {
        let whole = read(&view(4096, 4, 0, &[32, 32], &[32, 1])).unwrap();
        assert!(spans_whole(&whole));
        let transposed = read(&view(4096, 4, 0, &[32, 32], &[1, 32])).unwrap();
        assert!(spans_whole(&transposed));
        let scalar = read(&view(4, 4, 0, &[], &[])).unwrap();
        assert!(spans_whole(&scalar));
        for (offset, shape, strides) in [
            (1, &[1023][..], &[1][..]), // a storage offset
            (0, &[1023], &[1]),         // stops short of the end
            (0, &[32, 16], &[32, 1]),   // a slice of the columns
            (0, &[0, 32], &[32, 1]),    // empty
            (1023, &[1024], &[-1]),     // negative stride
        ] {
            let v = read(&view(4096, 4, offset, shape, strides)).unwrap();
            assert!(!spans_whole(&v), "{offset} {shape:?} {strides:?}");
        }
        // Views read_view refuses: spans_whole says no without overflowing either.
        for (shape, strides) in [
            (vec![1024], vec![-1]),
            (vec![2, i64::MAX], vec![1, i64::MAX]),
            (vec![2], vec![i64::MAX]),
        ] {
            let mut v = read(&view(4096, 4, 0, &[1], &[1])).unwrap();
            v.dims = [shape, strides].concat();
            assert!(!spans_whole(&v), "{:?} {:?}", v.shape(), v.strides());
        }
    }

    #[test]
    fn bad_views_are_refused() {
        let good = view(4096, 4, 0, &[1024], &[1]);
        assert!(read(&good).is_ok());
        assert!(read_view(std::ptr::null(), 10).is_err());
        assert!(read(&good[..GPU_ARENA_DLPACK_VIEW_HEAD - 1]).is_err());
        assert!(
            read(&good[..good.len() - 1]).is_err(),
            "ndim disagrees with the length"
        );
        let mut wrong_bits = good.clone();
        wrong_bits[2] = 2;
        assert!(read(&wrong_bits).is_err(), "32-bit dtype with 2-byte items");
        assert!(read(&view(4096, 4, 0, &[-1], &[1])).is_err());
        assert!(read(&view(4096, 4, -1, &[1], &[1])).is_err());
        assert!(read(&view(-1, 4, 0, &[1], &[1])).is_err());
        let mut ndim_65 = view(4096, 4, 0, &[1; 65], &[1; 65]);
        assert!(read(&ndim_65).is_err(), "ndim 65");
        ndim_65[7] = -1;
        assert!(read(&ndim_65).is_err(), "negative ndim");
        for dtype in [18 | 32 << 8 | 1 << 16, -1, 1 << 32 | 2 | 32 << 8 | 1 << 16] {
            let mut unknown = good.clone();
            unknown[1] = dtype;
            assert!(read(&unknown).is_err(), "dtype {dtype:#x}");
        }
    }

    #[test]
    fn a_view_reaching_outside_its_storage_is_refused() {
        for (offset, shape, strides) in [
            (0, &[1024][..], &[1][..]), // exactly the storage
            (1023, &[1024], &[-1]),     // backwards, exactly the storage
            (4095, &[0, 8], &[1, 1]),   // empty: reaches nothing
            (1000, &[2, 12], &[12, 1]), // the last 24 elements
            (0, &[4, 4], &[0, 0]),      // broadcast
        ] {
            let v = view(4096, 4, offset, shape, strides);
            assert!(read(&v).is_ok(), "{offset} {shape:?} {strides:?}");
        }
        for (offset, shape, strides) in [
            (0, &[1025][..], &[1][..]),          // one element past the end
            (1, &[1024], &[1]),                  // the offset pushes it out
            (0, &[1024], &[-1]),                 // backwards from 0: before the start
            (0, &[32, 33], &[32, 1]),            // the last row runs over
            (0, &[2], &[i64::MAX]),              // overflows
            (0, &[3, 2], &[i64::MAX / 2, 1]),    // overflows when summed
            (i64::MAX, &[1], &[1]),              // (offset + 1) * itemsize overflows
            (0, &[2, 2], &[i64::MIN, i64::MIN]), // negative overflow
        ] {
            let v = view(4096, 4, offset, shape, strides);
            assert!(read(&v).is_err(), "{offset} {shape:?} {strides:?}");
        }
    }
}
