"""Serving a model to many researchers over HTTP (issue 37, in progress): so far the wire format
(``wire``), the body every request and reply is; ``docs/serving.md`` documents it."""
