"""The executor's sync core: the model runner, the device backends, sampling and graph capture."""
