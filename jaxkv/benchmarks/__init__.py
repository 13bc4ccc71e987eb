"""What the benchmark scripts share: timing (:mod:`jaxkv.benchmarks.timing`) and the peer
kernels they are compared with (:mod:`jaxkv.benchmarks.kernel_peers`)."""
