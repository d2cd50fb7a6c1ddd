"""Configs shipped inside the package, so that they are there after a plain ``pip install``:
``demo.yaml`` is what ``areno demo`` runs (``areno.api.pipeline.DEMO_CONFIG``)."""
