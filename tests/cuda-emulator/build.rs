//! The library's soname is the driver's (`libcuda.so.1`): cudarc resolves the driver by name, and
//! the dynamic loader answers a name with an already loaded library whose soname matches, so once
//! `HP_CUDA_LIB` has loaded the emulator, cudarc's lookup lands on it too.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
