"""What the benchmark scripts share: timing (:mod:`jaxkv.benchmarks.timing`), the peer
kernels they are compared with (:mod:`jaxkv.benchmarks.kernel_peers`) and vLLM's own KV
cache manager behind jaxkv's scheduler (:mod:`jaxkv.benchmarks.vllm_manager`)."""
