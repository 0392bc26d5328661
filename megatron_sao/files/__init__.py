"""File helpers every layer may use: directories written aside and renamed into place, and a
safetensors file read only after its header and sizes were checked."""
