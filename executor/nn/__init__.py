"""The torch side of the model zoo: layers of ``gpt``, ``cnn`` and ``supernet`` that match the simulator's
``LayerGraph`` exactly, stage construction, seeds and synthetic data (``stages``), optimizers (``optim``) and the
split of a backward into input and weight gradients for zero-bubble schedules (``split_backward``).
"""
