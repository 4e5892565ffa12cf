"""flashqla: Gated DeltaNet chunked-prefill kernels for NVIDIA Hopper (sm_90a).

    import flashqla
    o, final_state = flashqla.chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True)

The API mirrors FLA's ``chunk_gated_delta_rule`` ([B, T, H, D] layout, argument
names, defaults). Where the sm_90a kernels cannot run (no Hopper GPU, extension
not built) a PyTorch implementation runs instead, with a one-time warning.
"""
from ._backend import extension_loaded, kernels_available
from .api import chunk_gated_delta_rule, chunk_gdn, chunk_gdn_bwd, chunk_gdn_fwd, chunk_local_cumsum

__version__ = "0.1.0"
__all__ = ["chunk_gdn", "chunk_gated_delta_rule", "chunk_gdn_fwd", "chunk_gdn_bwd", "chunk_local_cumsum", "kernels_available", "extension_loaded",
           "__version__"]
