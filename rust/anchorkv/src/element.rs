//! Element types of host buffers: `f32`, and the 16-bit formats as bit patterns (`F16`,
//! `Bf16`, each a `u16` with its meaning in the type, so a slice says what it holds).

use std::slice;

use crate::DType;

mod sealed {
    pub trait Sealed {}
}

/// A tensor element the library reads and writes. Sealed: f32, F16 and Bf16.
pub trait Element: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// The `akv_dtype` of buffers of this element.
    const DTYPE: DType;
    /// The nearest value of this type (round to nearest even).
    fn from_f32(value: f32) -> Self;
    /// The exact f32 of this value.
    fn to_f32(self) -> f32;
}

impl sealed::Sealed for f32 {}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn from_f32(value: f32) -> Self {
        value
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// IEEE binary16, as its bits.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// bfloat16 (the upper half of an f32), as its bits.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

macro_rules! bits_views {
    ($type:ty) => {
        impl $type {
            /// View raw bits (e.g. a model's `u16` tensor) as this type, without copying.
            pub fn from_bits_slice(bits: &[u16]) -> &[$type] {
                // SAFETY: repr(transparent) over u16: same size, alignment and validity.
                unsafe { slice::from_raw_parts(bits.as_ptr().cast(), bits.len()) }
            }
            /// View raw bits as this type, mutably, without copying.
            pub fn from_bits_slice_mut(bits: &mut [u16]) -> &mut [$type] {
                // SAFETY: as above; the borrow is carried over.
                unsafe { slice::from_raw_parts_mut(bits.as_mut_ptr().cast(), bits.len()) }
            }
            /// The raw bits of these values, without copying.
            pub fn to_bits_slice(values: &[$type]) -> &[u16] {
                // SAFETY: as above.
                unsafe { slice::from_raw_parts(values.as_ptr().cast(), values.len()) }
            }
        }
    };
}
bits_views!(F16);
bits_views!(Bf16);

impl sealed::Sealed for F16 {}
impl Element for F16 {
    const DTYPE: DType = DType::F16;

    /// Round to nearest, ties to even; overflow gives infinity.
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exponent = ((bits >> 23) & 0xff) as i32;
        let mantissa = bits & 0x7f_ffff;
        if exponent == 0xff {
            let nan = if mantissa != 0 { 0x200 | (mantissa >> 13) as u16 } else { 0 };
            return F16(sign | 0x7c00 | nan);
        }
        let half_exponent = exponent - 127 + 15;
        if half_exponent >= 0x1f {
            return F16(sign | 0x7c00);
        }
        if half_exponent <= 0 {
            if half_exponent < -10 {
                return F16(sign); // below half the smallest subnormal
            }
            let significand = mantissa | 0x80_0000;
            let shift = (14 - half_exponent) as u32;
            let rounded = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift;
            return F16(sign | rounded as u16);
        }
        let mut out = ((half_exponent as u32) << 10) | (mantissa >> 13);
        let rest = mantissa & 0x1fff;
        if rest > 0x1000 || (rest == 0x1000 && out & 1 == 1) {
            out += 1; // a carry into the exponent is the correct result
        }
        F16(sign | out as u16)
    }

    fn to_f32(self) -> f32 {
        let sign = if self.0 & 0x8000 != 0 { -1.0f32 } else { 1.0 };
        let exponent = ((self.0 >> 10) & 0x1f) as u32;
        let mantissa = (self.0 & 0x3ff) as u32;
        match exponent {
            0 => sign * mantissa as f32 * f32::powi(2.0, -24),
            0x1f => f32::from_bits(((self.0 as u32 & 0x8000) << 16) | 0x7f80_0000 | (mantissa << 13)),
            _ => f32::from_bits(((self.0 as u32 & 0x8000) << 16) | ((exponent + 112) << 23) | (mantissa << 13)),
        }
    }
}

impl sealed::Sealed for Bf16 {}
impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;

    /// Round to nearest, ties to even; NaN stays NaN.
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        if value.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        Bf16(((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }

    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_and_rounds_to_even() {
        for value in [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.1035156e-5, 5.9604645e-8, 0.333251953125] {
            assert_eq!(F16::from_f32(value).to_f32(), value, "{value}");
        }
        assert_eq!(F16::from_f32(1.0 + 1.0 / 2048.0).0, 0x3c00); // tie: to even (down)
        assert_eq!(F16::from_f32(1.0 + 3.0 / 2048.0).0, 0x3c02); // tie: to even (up)
        assert_eq!(F16::from_f32(70000.0).0, 0x7c00);
        assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(F16::from_f32(2.0e-8).0, 0); // below half the smallest subnormal
        assert_eq!(F16::from_f32(4.0e-8).0, 1); // above it: the smallest subnormal
    }

    #[test]
    fn bf16_rounds_to_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8000)).0, 0x3f80); // tie, even stays
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f81_8000)).0, 0x3f82); // tie, odd rounds up
        assert_eq!(Bf16(0x4049).to_f32(), f32::from_bits(0x4049_0000));
    }

    #[test]
    fn bit_views_share_memory() {
        let bits = [0x3c00u16, 0x4000];
        let halves = F16::from_bits_slice(&bits);
        assert_eq!(halves[1].to_f32(), 2.0);
        assert_eq!(F16::to_bits_slice(halves).as_ptr(), bits.as_ptr());
    }
}
