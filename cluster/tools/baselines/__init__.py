"""What Tandem is compared with: Hugging Face generation of the target alone and assisted
generation."""
