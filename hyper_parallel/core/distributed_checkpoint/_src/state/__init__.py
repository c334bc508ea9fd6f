"""State dicts as the user holds them: flattening nested dicts to keys and back, key renaming
(topology mappers) and the train-state helpers (model, optimizers, RNG)."""
