"""The dsv4:: ops, their fakes and the vLLM-compatible Python wrappers, one module per family."""
