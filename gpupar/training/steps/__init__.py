"""One step per kind, each readable top to bottom, all run through one K-steps call and one evaluation path.

    step.py       Step (what every kind offers), train_function, LocalCalls, evaluation
    parts.py      the pieces kinds share: float32 outputs, the forward pass, loss and gradients, accumulation, skips
    compiled.py   KerasCompiledStep (Keras' compiled loss and metrics over the global batch), CompiledStep
    own.py        OwnStep: the model's own train_step and test_step
    pipelined.py  PipelineStep: a chain model's stages over micro-batches (model_parallel)
"""
