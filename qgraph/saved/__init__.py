"""Programs that travel: ``ig.save(path)`` writes an instrumented program, ``qgraph.load(path)`` runs it
without the model's class or modeling file (``write``, ``read``)."""
from .read import LoadedProgram, SavedProgramError, load
from .write import save

__all__ = ["LoadedProgram", "SavedProgramError", "load", "save"]
