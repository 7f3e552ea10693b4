(key, step, model, quantization) => {
  if (!key) return;
  (__POST__)({prepare: true, key, step, model, quantization}).catch(() => {});
}
