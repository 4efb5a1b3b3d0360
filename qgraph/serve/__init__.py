"""Serving one model to many researchers over HTTP (``qgraph serve``; its client ``qgraph.remote``).

The pipeline of a request: ``server`` (the ASGI app: routes, keys, limits) -> ``wire`` (the body's
format, parsed with bounds) -> ``request`` (the call's fields checked; ``edits`` turns edits given as
data back into edits, ``function`` a function edit's graph through the sandbox) -> ``batcher`` (the
queue; requests of one program share a forward) -> ``run`` (the instruments, one batched forward, each
reply its own rows). ``client`` and ``recipes`` are the researcher's side; ``cli`` the command.
``docs/serving.md`` documents the format for other clients.
"""
