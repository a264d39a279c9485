"""pipedejavu executor: runs a plan written by ``sim.run`` on real devices with torch.distributed (DESIGN §7).

Built so far: ``executor.modules`` — torch modules for the zoo's ``gpt`` and ``cnn`` that match the simulator's
``LayerGraph`` exactly (parameter counts, activation sizes), stage splits with split-independent seeded weights, and
seeded synthetic data. The L1 interpreter, launcher and profiler come with the rest of issue #3.
"""
