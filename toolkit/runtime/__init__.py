"""rtk's CPU engine (the ``cpu`` build target): checkpoint loader, paged KV cache, in-flight batching.

Modules: :mod:`.checkpoint` (read and dequantize exports), :mod:`.model` (the transformer forward
over a paged KV cache), :mod:`.kv_cache`, :mod:`.scheduler`, :mod:`.sampling`, :mod:`.engine`
(the public API: ``Engine``, ``BackgroundEngine``, ``EngineConfig``, ``GenerationRequest``).
Nothing heavy is imported here, so ``import toolkit.runtime`` stays cheap.
"""
