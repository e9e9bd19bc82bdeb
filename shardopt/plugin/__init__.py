"""Engine adapters: they only describe which piece of each matrix a rank holds."""
