"""The EPD HTTP proxy: media to the encoders first, then the request to prefill/decode.

An OpenAI-compatible front for a set of vLLM encoder instances and prefill/decode
instances that share encoder outputs through ecshare. Layout, each module one job:

* `config`: `ProxyConfig` and the `ecshare proxy` flags (no HTTP stack imported);
* `errors`: `ProxyError` and the OpenAI-shaped error body;
* `tenants`: the API-key file, each key's tenant, tenant-scoped uuids and salts;
* `parts`: what a client may put in content parts (uuids, embeddings, how many items);
* `edge`: the listening socket, with its connections capped;
* `metrics`: the Prometheus metrics, in a registry per proxy;
* `backends`: backend instances, picking one, ejecting and restoring them, health checks;
* `directory`: which backend holds which item now (a passive core fed by item events);
* `feeds`: the CURVE subscriptions to the instances' item events that feed the directory;
* `discovery`: membership at run time: registration (`/v1/members`) and DNS discovery;
* `fanout`: the encoder stage, finding media items, fanning them out, merging by mm_hash;
* `identity`: content keys of inline media, and the items the encoders reported for them;
* `routing`: which items skip the encoders, which prefill/decode instance and encoder
  a request goes to, one encode per new content;
* `forward`: the prefill/decode stage, relaying whole and streamed answers;
* `app`: the routes and the guard (API key, errors, metrics) around them;
* `server`: serving it, in a caller's loop or as the `ecshare proxy` command;
* `workers`: `--workers N` proxy processes on one port, under one supervisor;
* `shared`: what the workers share through their supervisor (registered members,
  encodes in flight): its wire and its passive core;
* `link`: a worker's end of that channel.

It imports neither vllm nor torch.

May import: anything in ecshare (it uses only ecshare.config, ecshare.apps.ready,
ecshare.protocol's `ec_transfer_params` schema, ecshare.control's keys and
ecshare.peer.items' wire, and speaks HTTP to the engines).
"""

from ecshare.apps.proxy.config import ProxyConfig, add_proxy_arguments, config_from_args

__all__ = ["ProxyConfig", "add_proxy_arguments", "config_from_args"]
