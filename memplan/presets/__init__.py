"""Presets: the model and GPU YAML files of configs/ and transformers config.json files, read as data (files,
catalog, hf_config), and turned into a runnable config (batch). Above the inventory layer: a transformers
config is matched to its shipped traced inventory."""
