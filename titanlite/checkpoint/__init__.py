"""Checkpointing: DCP save/load with atomic step folders (`manager`, `folders`, `rank_state`) and
Hugging Face safetensors interop (`hf`)."""
