"""Training-loop backends. Importing the package registers the built-in ``areno`` backend, so
``base.resolve_backend`` finds it without importing it back."""

from areno.api.backend.areno import backend as _areno_backend  # registers "areno"
