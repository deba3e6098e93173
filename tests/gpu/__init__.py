"""Checks that need CUDA GPUs (marked `gpu`, run by `make test-gpu` on a GPU machine; every one
skips elsewhere), a file per package they exercise."""
