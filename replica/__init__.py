"""One model replica: the engine core (scheduler, engine, input and output processing)
and its executor (model runner, attention backends, CPU kernels, LoRA, tensor
parallelism, speculative decoding). The offline API is exported by `kvserve`."""
