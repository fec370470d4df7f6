"""Integrations with model libraries (import the submodule you need: `tritonformer.integrations.hf`)."""
