"""Checkpointing: DCP save/load with atomic step folders (`manager`, `resume`, `folders`, `rank_state`, `async_save`,
`lr_schedule`, `resume_policy`), model weights alone for tools and initial loads (`weights`) and Hugging Face
safetensors interop (`hf`)."""
