"""The ``dar`` command, the dev stack it supervises (``dar dev``) and the embedded
PostgreSQL and Redis it can start. Above the API in the layers: it uses the API's token
helpers, and nothing below imports it."""
