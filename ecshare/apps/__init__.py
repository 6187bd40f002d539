"""The operator apps: what a person runs, built on the core and the engine integration.

The tree shows the layers, lowest first:

* the core, which knows entries, grants and peers and nothing of any engine:
  `errors`, `config`, `protocol`, `store`, `transport`, `control`, `peer`, and
  `metrics` (Prometheus, reading the parts' own samples);
* the engine integration: `ecshare.vllm`, the vLLM EC connector;
* the apps, here: `cli` (the `ecshare` command), `launch` (`ecshare launch`),
  `demo` and `epd_demo`, `ready` (the one typed ready line every long-running
  command prints), `proxy` (the EPD HTTP proxy), `bench`, `chaos` (the fault
  harness) and `ops` (`ecshare doctor` and `ecshare status`).

Test doubles live under tests/, outside the package. tests/test_layers.py holds
every module to the arrows: each layer imports only from those below it.

May import: anything in ecshare; nothing outside ecshare.apps imports it but
ecshare.__main__.
"""
