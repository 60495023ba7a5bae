"""Edge deployment: export (ONNX + parity), quantize (INT8/FP16 + accuracy gate), compile (TVM),
package (edge tar with native and Python runners) and edge verify (under qemu-aarch64)."""
