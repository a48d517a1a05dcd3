"""The application: one evaluation of a registry entry (``runners.app.main.run``, called by run.py), built
from the engine (runners.engine), the evaluation (evals) and the registry."""
