"""Pure-torch references: the CPU implementations and the test oracles. They import only `layout`."""
