"""Kiln: serve a language model over the OpenAI API and make it better while it serves."""

__version__ = "0.1.0"
