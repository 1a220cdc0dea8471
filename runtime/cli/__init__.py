"""The terminal: `remat report | check | sweep` (`main`), the report of one plan (`report`), its
plots (`plots`), and a model under planning from loading to real steps (`session`)."""
from .main import main

__all__ = ["main"]
