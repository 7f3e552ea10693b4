async (key, model, quantization, width, temperature) => {
  const label = document.querySelector('#present-text .dp-present-label');
  if (!key || !label || label.dataset.hidden === '1') return;
  const step = Number(label.dataset.step);
  const seq = window.dpPresentSeq = (window.dpPresentSeq || 0) + 1;
  let reply;
  try {
    const res = await (__POST__)({view: 'presenter', key, step, model, quantization, width, knobs: {temperature}});
    reply = await res.json();
  } catch (err) {
    return;
  }
  if (seq !== window.dpPresentSeq || !reply.figure) return;
  (__DRAW_INTO__)('#present-chart .js-plotly-plot', () => {
    const now = document.querySelector('#present-text .dp-present-label');
    return now && now.dataset.hidden !== '1' ? Number(now.dataset.step) : -1;
  })(reply.figure);
}
