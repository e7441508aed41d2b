"""The serving engine: one scheduler thread owning a model worker.

``ModelWorker`` holds the model, tokenizer and weight state; ``Scheduler`` is
the single thread that runs forward steps and admin operations between them;
``Request`` is one generation's state; ``sampling`` turns logits into tokens;
``WeightsChecker`` digests the live weights.
"""
