"""Training-loop backends. Importing the package registers the built-in ``areno`` backend."""

from areno.api.backend.areno import backend as _areno_backend  # noqa: F401  (registers "areno")
