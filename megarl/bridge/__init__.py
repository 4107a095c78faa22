"""HF <-> megatron-core bridge: one mapping per architecture, streaming import and bucketed export.

    spec = load_spec(hf_dir)                                   # config.json -> ArchSpec (BridgeError on anything unsupported)
    model, spec = megarl.megatron.model.build_and_load(hf_dir) # any TP/PP/EP layout, each rank reads its slices
    for bucket in export_hf_weights(model, spec): ...          # any layout -> [(hf_name, full tensor)], collective
"""
from megarl.bridge.exporter import export_hf_weights, export_to_dict
from megarl.bridge.hf_config import (SUPPORTED_ARCHITECTURES, ArchSpec, BridgeError, check_layout, load_spec,
                                     spec_from_dict)
from megarl.bridge.importer import SafetensorsCheckpoint, check_checkpoint, load_hf_weights
from megarl.bridge.mapping import Mapping, padded_vocab_size

__all__ = ["ArchSpec", "BridgeError", "Mapping", "SUPPORTED_ARCHITECTURES", "SafetensorsCheckpoint", "check_checkpoint",
           "check_layout", "export_hf_weights", "export_to_dict", "load_hf_weights", "load_spec",
           "padded_vocab_size", "spec_from_dict"]
