() => { document.querySelector('#lessons-run')?.click(); }
