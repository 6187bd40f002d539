"""ecshare: peer-to-peer sharing of multimodal encoder outputs between LLM instances.

The core imports with only pyzmq, msgspec and numpy installed; torch, nixl and
vllm are optional and imported only by the parts that need them.
"""

__version__ = "0.1.0"
