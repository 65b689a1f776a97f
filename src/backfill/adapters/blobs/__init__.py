"""Content storage: raw byte stores and the encryption layer over them."""
