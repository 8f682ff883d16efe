"""The rule catalogue as a plug-in package: one module per family of rules, one class per rule.

Every module here is imported by ``server.rules.registry`` and its ``@register``-ed classes
become the catalogue; adding a rule means adding a class (in a family's module, or a new module)
— nothing else lists rules. See docs/rules.md, "Adding a rule".
"""
