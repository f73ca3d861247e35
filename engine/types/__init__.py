"""The engine's public types, the vocabulary its callers speak: settings (`EngineConfig`),
request parameters (`SamplingParams`, `PoolingParams`, `StructuredOutputs`,
`LoRARequest`), what comes back (`RequestOutput`, the pooling outputs, `EngineStats`)
and the profiling hook. `tokenmill.engine` re-exports them; nothing here imports the
engine's machinery."""
