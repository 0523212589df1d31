"""The Hugging Face release family: sharded folders with their index (`folder`) and PEFT adapters (`adapter`)."""
