// The translation unit that cmake/VarunaTorchPch.cmake precompiles libtorch's
// headers with; it has nothing of its own.
