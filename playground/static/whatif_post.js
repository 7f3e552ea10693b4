(body) => fetch(((window.gradio_config && window.gradio_config.root) || location.origin)
  .replace(/\/+$/, '') + __ROUTE__, {method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)})
