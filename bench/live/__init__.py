"""Measurements of the running app: over HTTP (the OpenAI routes and the operator routes
``/v1/pdserve/stats``), plus the Serve handles of ``bench pd``, which speak the engine wire
protocol (:mod:`deployments.protocol`) and nothing else of the app."""
