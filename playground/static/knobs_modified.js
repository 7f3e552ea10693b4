(choice) => {
  if (!choice || choice === __CUSTOM__) return '<small>Custom settings</small>';
  const escape = {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#x27;'};
  const name = String(choice).replace(/[&<>"']/g, c => escape[c]);
  return `<small>Preset <b>${name}</b> · <i>modified</i></small>`;
}
