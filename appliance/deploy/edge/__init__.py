"""Edge tooling: qemu, the aarch64 sysroot, the glibc floor; install.sh, run.py and runner.cc travel
inside the edge package."""
