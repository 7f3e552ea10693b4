(key, model, quantization) => {
  const label = document.querySelector('#' + __ID_PRESENT_TEXT__ + ' .dp-present-label');
  if (!key || !label) return;
  (__POST__)({prepare: true, key, step: Number(label.dataset.step), model, quantization}).catch(() => {});
}
